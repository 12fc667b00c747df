"""A WebSocket connection served over an asyncio stream pair, on the `websockets` sans-IO protocol.

The HTTP front has already parsed the request (h11) and chosen the subprotocol; ``accept`` answers
the handshake and the connection then exchanges whole messages. `websockets` validates the
handshake, frames, masks, reassembly limits, answers pings and runs the closing handshake; this
module only moves its bytes and gathers fragments into messages.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

from websockets.client import ClientProtocol
from websockets.exceptions import InvalidState, ProtocolError
from websockets.frames import Frame, Opcode
from websockets.http11 import Request
from websockets.protocol import Protocol, State
from websockets.server import ServerProtocol
from websockets.uri import parse_uri

_READ_SIZE = 64 * 1024

Message = bytes | str


class WebSocketClosed(ConnectionError):
    """The WebSocket connection is closed (or closing): nothing more can be sent."""


class WebSocketConnection:
    """One WebSocket connection, either side (``accept`` for a server, ``opened`` for a client)."""

    def __init__(
        self, protocol: Protocol, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._protocol = protocol
        self._reader = reader
        self._writer = writer
        self._messages: collections.deque[Message] = collections.deque()
        self._fragments: list[bytes] = []
        self._fragment_opcode: Opcode | None = None
        self._eof = asyncio.Event()
        self._close_received = asyncio.Event()
        self.last_activity = asyncio.get_running_loop().time()
        self.subprotocol: str | None = None

    @classmethod
    async def accept(
        cls,
        head: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        subprotocol: str | None,
        initial: bytes,
        max_message: int,
    ) -> WebSocketConnection | None:
        """Answer the handshake in ``head`` (the request's bytes) with ``subprotocol``; None (the
        refusal sent) if it is invalid."""
        protocol = ServerProtocol(max_size=max_message)
        protocol.receive_data(head)
        requests = [event for event in protocol.events_received() if isinstance(event, Request)]
        if not requests:
            writer.close()
            return None
        # The subprotocol is chosen already: `websockets` would refuse names such as
        # "SPDY/3.1+portforward.k8s.io" (a "/" is no token character), which clients do send.
        request = requests[0]
        del request.headers["Sec-WebSocket-Protocol"]
        response = protocol.accept(request)
        if response.status_code == 101 and subprotocol:
            response.headers["Sec-WebSocket-Protocol"] = subprotocol
        protocol.send_response(response)
        connection = cls(protocol, reader, writer)
        await connection._flush()
        if response.status_code != 101:
            writer.close()
            return None
        connection.subprotocol = subprotocol
        await connection.receive_initial(initial)
        return connection

    @classmethod
    def opened(
        cls,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        subprotocol: str | None,
        max_message: int,
    ) -> WebSocketConnection:
        """The client side of a connection whose handshake is done (``client.py`` does it with h11)."""
        protocol = ClientProtocol(parse_uri("ws://streaming/"), state=State.OPEN, max_size=max_message)
        connection = cls(protocol, reader, writer)
        connection.subprotocol = subprotocol
        return connection

    async def receive_initial(self, data: bytes) -> None:
        """Bytes the peer sent right after the handshake, read with it."""
        if data:
            self._receive(data)
            await self._flush()

    @property
    def closed(self) -> bool:
        return self._eof.is_set()

    async def wait_closed(self) -> None:
        await self._eof.wait()

    async def recv(self) -> Message | None:
        """The next whole message; None once the connection is closed."""
        while not self._messages:
            if self._eof.is_set():
                return None
            try:
                data = await self._reader.read(_READ_SIZE)
            except OSError:
                data = b""
            if data:
                self.last_activity = asyncio.get_running_loop().time()
                self._receive(data)
            else:
                self._protocol.receive_eof()
                self._eof.set()
            with contextlib.suppress(OSError):
                await self._flush()
            if self._protocol.state is State.CLOSED:
                self._eof.set()
        return self._messages.popleft()

    async def send(self, message: Message) -> None:
        try:
            if isinstance(message, str):
                self._protocol.send_text(message.encode())
            else:
                self._protocol.send_binary(message)
        except InvalidState as exc:
            raise WebSocketClosed("the WebSocket connection is closing") from exc
        await self._flush()
        self.last_activity = asyncio.get_running_loop().time()

    async def close(self, grace: float, code: int = 1000) -> None:
        """Closing handshake: send a close frame, give the peer ``grace`` s to answer, then cut.

        The peer's answer is read by whoever reads the connection (``recv`` keeps running in the
        session's reader until it returns None). Once it has come the server closes the TCP
        connection, as RFC 6455 has it (the client waits for that).
        """
        if self._protocol.state is State.OPEN:
            self._protocol.send_close(code)
            with contextlib.suppress(OSError):
                await self._flush()
        answered = asyncio.ensure_future(self._close_received.wait())
        ended = asyncio.ensure_future(self._eof.wait())
        try:
            await asyncio.wait({answered, ended}, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        finally:
            answered.cancel()
            ended.cancel()
        self._eof.set()
        self._writer.close()

    def abort(self) -> None:
        self._eof.set()
        self._writer.transport.abort()

    def _receive(self, data: bytes) -> None:
        try:
            self._protocol.receive_data(data)
        except ProtocolError:
            self._eof.set()
        for event in self._protocol.events_received():
            if isinstance(event, Frame):
                self._gather(event)

    def _gather(self, frame: Frame) -> None:
        if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
            self._fragment_opcode, self._fragments = frame.opcode, [bytes(frame.data)]
        elif frame.opcode is Opcode.CONT and self._fragment_opcode is not None:
            self._fragments.append(bytes(frame.data))
        else:
            if frame.opcode is Opcode.CLOSE:
                self._close_received.set()
            return  # control frames: the protocol answered them already
        if frame.fin and self._fragment_opcode is not None:
            data = b"".join(self._fragments)
            text = self._fragment_opcode is Opcode.TEXT
            self._fragments, self._fragment_opcode = [], None
            self._messages.append(data.decode("utf-8", "replace") if text else data)

    async def _flush(self) -> None:
        for data in self._protocol.data_to_send():
            if data:
                self._writer.write(data)
            elif self._writer.can_write_eof() and not self._writer.is_closing():
                self._writer.write_eof()
        await self._writer.drain()


class WebSocketTransport:
    """A ``ByteTransport`` of the bytes carried in binary messages (SPDY tunnelled in WebSocket)."""

    def __init__(self, connection: WebSocketConnection, grace: float) -> None:
        self._connection = connection
        self._grace = grace
        self._pending = b""

    async def read(self, max_bytes: int) -> bytes:
        while not self._pending:
            message = await self._connection.recv()
            if message is None:
                return b""
            if isinstance(message, bytes):
                self._pending = message
        data, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
        return data

    async def write(self, data: bytes) -> None:
        try:
            await self._connection.send(data)
        except WebSocketClosed as exc:
            raise ConnectionResetError(str(exc)) from exc

    async def close_write(self) -> None:
        await self._connection.close(self._grace)

    def abort(self) -> None:
        self._connection.abort()
