"""The Kubernetes channel protocol over WebSocket: numbered byte channels in one connection.

Every message starts with its channel number (``channel.k8s.io``, ``v4.channel.k8s.io``,
``v5.channel.k8s.io``: one byte; the ``base64`` variants: one ASCII digit, then the data in
base64). v5 adds a close signal: the message ``[255, n]`` ends channel ``n`` (a client's stdin EOF).
Messages for channels nobody reads are dropped, as the kubelet's wsstream does.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging

from auraed.cri.streaming.websocket import WebSocketConnection

log = logging.getLogger(__name__)

CLOSE_CHANNEL = 255
_QUEUED_MESSAGES = 4
"""Messages held per input channel before the connection is not read (TCP pushes back)."""


class ChannelClosed(ConnectionError):
    """The connection ended before the channel did."""


class ChannelInput:
    """What the client sends on one channel: ``read`` gives b"" after its close signal."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(_QUEUED_MESSAGES)
        self._closed = False
        self._lost = False
        self._discard = False

    async def read(self) -> bytes:
        if self._closed and self._queue.empty():
            if self._lost:
                raise ChannelClosed("the connection ended")
            return b""
        data = await self._queue.get()
        if data is None:
            if self._lost:
                raise ChannelClosed("the connection ended")
            return b""
        return data

    def discard_incoming(self) -> None:
        self._discard = True
        while not self._queue.empty():
            self._queue.get_nowait()

    async def deliver(self, data: bytes) -> None:
        if not self._closed and not self._discard and data:
            await self._queue.put(data)

    def end(self, *, lost: bool) -> None:
        if self._closed:
            return
        self._closed, self._lost = True, lost
        if self._discard:
            return
        if self._queue.full():
            # A reader is behind: it sees the end after what is queued.
            asyncio.get_running_loop().create_task(self._queue.put(None))
        else:
            self._queue.put_nowait(None)


class ChannelOutput:
    """What this side sends on one channel."""

    def __init__(self, mux: ChannelMux, number: int) -> None:
        self._mux = mux
        self._number = number

    async def write(self, data: bytes) -> None:
        await self._mux.send(self._number, data)

    async def close_write(self) -> None:
        """Output channels end with the connection (the kubelet sends no close signal of its own)."""


class ChannelMux:
    def __init__(self, connection: WebSocketConnection, *, base64_encoded: bool, close_signal: bool) -> None:
        self.connection = connection
        self._base64 = base64_encoded
        self._close_signal = close_signal
        self._inputs: dict[int, ChannelInput] = {}

    def input(self, number: int) -> ChannelInput:
        return self._inputs.setdefault(number, ChannelInput())

    def output(self, number: int) -> ChannelOutput:
        return ChannelOutput(self, number)

    async def send(self, number: int, data: bytes) -> None:
        if self._base64:
            await self.connection.send(chr(ord("0") + number) + base64.b64encode(data).decode("ascii"))
        else:
            await self.connection.send(bytes((number,)) + data)

    async def run(self) -> None:
        """Route the client's messages to their channels until the connection closes."""
        try:
            while (message := await self.connection.recv()) is not None:
                await self._route(message.encode() if isinstance(message, str) else message)
        finally:
            for channel in self._inputs.values():
                channel.end(lost=True)

    async def _route(self, message: bytes) -> None:
        if not message:
            return
        number, data = message[0], message[1:]
        if self._close_signal and number == CLOSE_CHANNEL:
            if len(data) == 1 and data[0] in self._inputs:
                self._inputs[data[0]].end(lost=False)
            return
        if self._base64:
            number -= ord("0")
            try:
                data = base64.b64decode(data, validate=True)
            except binascii.Error:
                log.info("dropped a WebSocket message that is not base64 on channel %d", number)
                return
        channel = self._inputs.get(number)
        if channel is not None:
            await channel.deliver(data)
