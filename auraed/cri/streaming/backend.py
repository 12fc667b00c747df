"""What the streaming server needs from the runtime: the requests it serves and the backend's types.

The CRI's Exec, Attach and PortForward RPCs validate their requests into these values and register
them with ``StreamingServer.url_for``; once a client dials the URL, the server asks the
``StreamingBackend`` to start the session and pipes its byte streams to the client.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class ExecRequest:
    """Run ``cmd`` in a container, with the standard streams the client asked for."""

    container_id: str
    cmd: tuple[str, ...]
    tty: bool = False
    stdin: bool = False
    stdout: bool = True
    stderr: bool = True


@dataclasses.dataclass(frozen=True)
class AttachRequest:
    """Join a running container's standard streams (its stdin when it was started with one)."""

    container_id: str
    tty: bool = False
    stdin: bool = False
    stdout: bool = True
    stderr: bool = True


@dataclasses.dataclass(frozen=True)
class PortForwardRequest:
    """Forward connections to ports of a pod's network namespace.

    ``ports`` is what the CRI request named: the client names the port of each connection over
    SPDY; the kubelet's WebSocket channel protocol forwards exactly these.
    """

    pod_sandbox_id: str
    ports: tuple[int, ...] = ()


StreamingRequest = ExecRequest | AttachRequest | PortForwardRequest


@dataclasses.dataclass(frozen=True)
class TerminalSize:
    width: int
    height: int


class ByteSource(Protocol):
    """A process output stream: ``read`` returns b"" at its end (asyncio.StreamReader is one)."""

    async def read(self, n: int = -1) -> bytes: ...


class ByteSink(Protocol):
    """A process input stream."""

    async def write(self, data: bytes) -> None:
        """Deliver ``data``, waiting while the process does not read."""
        ...

    async def close(self) -> None:
        """End of input: the process reads EOF."""
        ...


class ProcessSession(Protocol):
    """A started exec, or an attach to a container: its streams, its terminal, its end.

    ``stdin``/``stdout``/``stderr`` are None when the request did not ask for them (with a tty,
    stdout carries the terminal's output and stderr is None).
    """

    @property
    def stdin(self) -> ByteSink | None: ...

    @property
    def stdout(self) -> ByteSource | None: ...

    @property
    def stderr(self) -> ByteSource | None: ...

    async def resize(self, size: TerminalSize) -> None:
        """Set the terminal's size (only called for tty sessions)."""
        ...

    async def wait(self) -> int:
        """Wait for the exec'd process (or the attached container) to end: its exit code."""
        ...

    async def close(self) -> None:
        """End the session, always called last: an exec's process still running is killed, an
        attach detaches. Idempotent; must not raise."""
        ...


class StreamingBackend(Protocol):
    """The runtime behind the streaming server (the CRI implements it)."""

    async def exec(self, request: ExecRequest) -> ProcessSession:
        """Start ``request.cmd`` in the container. Raises (an AuraeError) when it cannot."""
        ...

    async def attach(self, request: AttachRequest) -> ProcessSession:
        """Attach to the container's streams. Raises (an AuraeError) when it cannot."""
        ...

    async def dial(self, pod_sandbox_id: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A TCP connection to ``port`` on localhost in the pod's network namespace.

        The server half-closes the writer (``write_eof``) when the client is done sending and
        closes it at the end. Raises (OSError, AuraeError) when the port cannot be reached.
        """
        ...
