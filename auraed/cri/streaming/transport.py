"""Byte transports a SPDY session runs over: a TCP connection, or SPDY tunnelled in a WebSocket."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol


class ByteTransport(Protocol):
    """An ordered, reliable byte stream in both directions."""

    async def read(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` bytes; b"" once the peer has closed its side."""
        ...

    async def write(self, data: bytes) -> None:
        """Send ``data``, waiting while the peer is not reading (backpressure)."""
        ...

    async def close_write(self) -> None:
        """Half-close: the peer reads the end of the stream; reading goes on."""
        ...

    def abort(self) -> None:
        """Close both directions at once, dropping what was not sent."""
        ...


class StreamTransport:
    """A ``ByteTransport`` over an asyncio stream pair (a TCP connection)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, initial: bytes = b""
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._initial = initial

    async def read(self, max_bytes: int) -> bytes:
        if self._initial:
            data, self._initial = self._initial[:max_bytes], self._initial[max_bytes:]
            return data
        return await self._reader.read(max_bytes)

    async def write(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    async def close_write(self) -> None:
        if self._writer.can_write_eof() and not self._writer.is_closing():
            with contextlib.suppress(OSError):
                self._writer.write_eof()

    def abort(self) -> None:
        self._writer.transport.abort()
