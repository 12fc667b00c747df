"""A client of the kubelet's streaming protocols, over SPDY/3.1 or WebSocket, as client-go speaks them.

``open_remote_command`` dials an exec or attach URL and returns a ``RemoteCommand`` (stdin,
stdout, stderr, resize, and the status from the error stream); ``run_remote_command`` runs one to
its end. ``open_port_forward`` dials a port-forward URL; each ``connect(port)`` is one forwarded
connection (an error and a data stream, as client-go opens them). The CRI tests and ``bench/`` use
it against auraed's server; it speaks to a kubelet's or containerd's server just the same.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import urllib.parse
from typing import Literal

import h11
from websockets.utils import accept_key, generate_key

from auraed.cri.streaming import portforward, remotecommand
from auraed.cri.streaming.channels import CLOSE_CHANNEL
from auraed.cri.streaming.spdy import Headers, SpdyLimits
from auraed.cri.streaming.spdy_session import SpdySession, SpdyStream, SpdyStreamClosed
from auraed.cri.streaming.transport import ByteTransport, StreamTransport
from auraed.cri.streaming.websocket import WebSocketClosed, WebSocketConnection, WebSocketTransport

Transport = Literal["spdy", "websocket"]
_STATUS_LIMIT = 1 << 20
_RESPONSE_LIMIT = 64 * 1024
_MESSAGE_SIZE = 32 * 1024
_MAX_MESSAGE = 1 << 20
"""Largest stdin piece per WebSocket message (client-go copies 32 KiB at a time)."""


class StreamingClientError(Exception):
    """The server refused the request (``status`` its HTTP status), or the session broke."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class CommandResult:
    """How a remote command ended: ``exit_code`` (None when the protocol version does not carry
    it and the server reported a failure), the failure ``message``, and the outputs collected."""

    exit_code: int | None
    message: str = ""
    stdout: bytes = b""
    stderr: bytes = b""


def parse_status(raw: bytes, version: int) -> CommandResult:
    """The error stream's content: metav1.Status JSON from v4 on, plain text before."""
    if version < 4:
        return CommandResult(0 if not raw else None, raw.decode("utf-8", "replace"))
    if not raw:
        raise StreamingClientError("the server closed the error stream without a status")
    status = json.loads(raw)
    if status.get("status") == "Success":
        return CommandResult(0)
    message = str(status.get("message", ""))
    if status.get("reason") == "NonZeroExitCode":
        for cause in (status.get("details") or {}).get("causes") or []:
            if cause.get("reason") == "ExitCode":
                return CommandResult(int(cause["message"]), message)
    return CommandResult(None, message)


class RemoteCommand:
    """One exec or attach session."""

    def __init__(self, version: int) -> None:
        self.version = version
        self._stdout: asyncio.Queue[bytes] = asyncio.Queue()
        self._stderr: asyncio.Queue[bytes] = asyncio.Queue()
        self._error = bytearray()
        self._done = asyncio.Event()
        self._failure: BaseException | None = None

    async def write_stdin(self, data: bytes) -> None:
        raise NotImplementedError

    async def close_stdin(self) -> None:
        raise NotImplementedError

    async def resize(self, width: int, height: int) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def read_stdout(self) -> bytes:
        """The next piece of stdout; b"" at its end."""
        return await self._stdout.get()

    async def read_stderr(self) -> bytes:
        return await self._stderr.get()

    async def wait(self) -> CommandResult:
        """The status once the server ended the session."""
        await self._done.wait()
        if self._failure is not None:
            raise StreamingClientError(f"the session broke: {self._failure}") from self._failure
        return parse_status(bytes(self._error), self.version)

    async def collect(self) -> CommandResult:
        """Read stdout and stderr to their ends, then the status."""
        stdout, stderr = await asyncio.gather(_drain(self._stdout), _drain(self._stderr))
        result = await self.wait()
        return dataclasses.replace(result, stdout=stdout, stderr=stderr)


async def _drain(queue: asyncio.Queue[bytes]) -> bytes:
    parts = bytearray()
    while chunk := await queue.get():
        parts += chunk
    return bytes(parts)


class _SpdyCommand(RemoteCommand):
    def __init__(self, spdy: SpdySession, reading: asyncio.Task[None], version: int) -> None:
        super().__init__(version)
        self._spdy = spdy
        self._reading = reading
        self._streams: dict[str, SpdyStream] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def open(self, *, stdin: bool, stdout: bool, stderr: bool, tty: bool, timeout: float) -> None:
        kinds = ["error", *(k for k, on in (("stdin", stdin), ("stdout", stdout)) if on)]
        if stderr and not tty:
            kinds.append("stderr")
        if tty and self.version >= 3:
            kinds.append("resize")
        for kind in kinds:
            headers: Headers = {remotecommand.STREAM_TYPE_HEADER: (kind,)}
            self._streams[kind] = await self._spdy.open_stream(headers, timeout)
        self._tasks = [
            asyncio.create_task(self._copy(self._streams.get("stdout"), self._stdout)),
            asyncio.create_task(self._copy(self._streams.get("stderr"), self._stderr)),
            asyncio.create_task(self._read_error()),
        ]

    async def _copy(self, stream: SpdyStream | None, queue: asyncio.Queue[bytes]) -> None:
        # A reset ends an output as its end does (spdystream reads it as EOF, so client-go does):
        # the kubelet resets every stream once it wrote the status.
        try:
            if stream is not None:
                while chunk := await stream.read():
                    await queue.put(chunk)
        except SpdyStreamClosed:
            pass
        finally:
            await queue.put(b"")

    async def _read_error(self) -> None:
        try:
            self._error += await self._streams["error"].read_all(_STATUS_LIMIT)
        except Exception as exc:
            self._failure = exc
        finally:
            self._done.set()

    async def write_stdin(self, data: bytes) -> None:
        await self._streams["stdin"].write(data)

    async def close_stdin(self) -> None:
        await self._streams["stdin"].close_write()

    async def resize(self, width: int, height: int) -> None:
        await self._streams["resize"].write(json.dumps({"Width": width, "Height": height}).encode() + b"\n")

    async def close(self) -> None:
        await self._spdy.close(grace=1.0)
        for task in (*self._tasks, self._reading):
            task.cancel()
        await asyncio.gather(*self._tasks, self._reading, return_exceptions=True)


class _WebSocketCommand(RemoteCommand):
    def __init__(self, connection: WebSocketConnection) -> None:
        protocol = connection.subprotocol or ""
        super().__init__(remotecommand.protocol_version(protocol))
        self._connection = connection
        self._base64 = "base64" in protocol
        self._close_signal = protocol == remotecommand.V5
        self._reading = asyncio.create_task(self._read())

    async def _read(self) -> None:
        queues = {remotecommand.CHANNEL_STDOUT: self._stdout, remotecommand.CHANNEL_STDERR: self._stderr}
        try:
            while (message := await self._connection.recv()) is not None:
                data = message.encode() if isinstance(message, str) else message
                if not data:
                    continue
                channel, payload = data[0], data[1:]
                if self._base64:
                    channel -= ord("0")
                    payload = base64.b64decode(payload)
                if channel in queues and payload:
                    await queues[channel].put(payload)
                elif channel == remotecommand.CHANNEL_ERROR:
                    self._error += payload
        except (ValueError, OSError) as exc:
            self._failure = exc
        finally:
            for queue in queues.values():
                await queue.put(b"")
            self._done.set()

    async def _send(self, channel: int, data: bytes) -> None:
        if self._base64:
            await self._connection.send(chr(ord("0") + channel) + base64.b64encode(data).decode())
        else:
            await self._connection.send(bytes((channel,)) + data)

    async def write_stdin(self, data: bytes) -> None:
        for start in range(0, len(data), _MESSAGE_SIZE):
            await self._send(remotecommand.CHANNEL_STDIN, data[start : start + _MESSAGE_SIZE])

    async def close_stdin(self) -> None:
        if not self._close_signal:
            raise StreamingClientError("only v5.channel.k8s.io can close stdin over WebSocket")
        # A command that ended first (its output read, the server closing) has no stdin left to close.
        with contextlib.suppress(WebSocketClosed):
            await self._connection.send(bytes((CLOSE_CHANNEL, remotecommand.CHANNEL_STDIN)))

    async def resize(self, width: int, height: int) -> None:
        await self._send(
            remotecommand.CHANNEL_RESIZE, json.dumps({"Width": width, "Height": height}).encode()
        )

    async def close(self) -> None:
        await self._connection.close(grace=1.0)
        self._reading.cancel()
        await asyncio.gather(self._reading, return_exceptions=True)


async def open_remote_command(
    url: str,
    *,
    transport: Transport = "spdy",
    stdin: bool = False,
    stdout: bool = True,
    stderr: bool = True,
    tty: bool = False,
    protocols: tuple[str, ...] | None = None,
    limits: SpdyLimits | None = None,
    timeout: float = 30.0,
) -> RemoteCommand:
    """Dial an exec or attach URL. ``protocols`` defaults to what client-go offers (SPDY: v5 down
    to v1; WebSocket: v5 only)."""
    if transport == "websocket":
        connection = await _websocket(url, protocols or (remotecommand.V5,), timeout)
        return _WebSocketCommand(connection)
    offered = protocols or (remotecommand.V5, *remotecommand.SPDY_PROTOCOLS)
    spdy_transport, protocol = await _spdy_upgrade(url, offered, timeout)
    spdy = SpdySession(spdy_transport, client=True, limits=limits)
    command = _SpdyCommand(spdy, asyncio.create_task(spdy.run()), remotecommand.protocol_version(protocol))
    try:
        await command.open(stdin=stdin, stdout=stdout, stderr=stderr, tty=tty, timeout=timeout)
    except BaseException:
        await command.close()
        raise
    return command


async def run_remote_command(
    url: str,
    *,
    transport: Transport = "spdy",
    stdin: bytes | None = None,
    stdout: bool = True,
    stderr: bool = True,
    tty: bool = False,
    timeout: float = 30.0,
) -> CommandResult:
    """Run an exec (or attach) to its end: ``stdin`` written then closed, the outputs collected."""
    command = await open_remote_command(
        url,
        transport=transport,
        stdin=stdin is not None,
        stdout=stdout,
        stderr=stderr,
        tty=tty,
        timeout=timeout,
    )
    try:

        async def feed() -> None:
            if stdin is not None:
                await command.write_stdin(stdin)
                await command.close_stdin()

        feeding = asyncio.create_task(feed())
        result = await command.collect()
        feeding.cancel()
        await asyncio.gather(feeding, return_exceptions=True)
        return result
    finally:
        await command.close()


class ForwardedConnection:
    """One forwarded connection: bytes to and from the port, and the server's error text."""

    def __init__(self, data: SpdyStream, error: SpdyStream) -> None:
        self.data = data
        self._error = error

    async def read(self) -> bytes:
        return await self.data.read()

    async def write(self, data: bytes) -> None:
        await self.data.write(data)

    async def close_write(self) -> None:
        await self.data.close_write()

    async def error(self) -> str:
        """What the server wrote on the error stream (empty when forwarding went well)."""
        return (await self._error.read_all(_STATUS_LIMIT)).decode("utf-8", "replace")

    async def close(self) -> None:
        await self.data.reset()


class PortForward:
    def __init__(self, spdy: SpdySession, reading: asyncio.Task[None], timeout: float) -> None:
        self._spdy = spdy
        self._reading = reading
        self._timeout = timeout
        self._next_request = 0

    async def connect(self, port: int) -> ForwardedConnection:
        request_id = str(self._next_request)
        self._next_request += 1
        headers: dict[str, tuple[str, ...]] = {
            portforward.STREAM_TYPE_HEADER: ("error",),
            portforward.PORT_HEADER: (str(port),),
            portforward.REQUEST_ID_HEADER: (request_id,),
        }
        error = await self._spdy.open_stream(headers, self._timeout)
        await error.close_write()
        data = await self._spdy.open_stream(
            {**headers, portforward.STREAM_TYPE_HEADER: ("data",)}, self._timeout
        )
        return ForwardedConnection(data, error)

    async def close(self) -> None:
        await self._spdy.close(grace=1.0)
        self._reading.cancel()
        await asyncio.gather(self._reading, return_exceptions=True)


async def open_port_forward(
    url: str, *, transport: Transport = "spdy", limits: SpdyLimits | None = None, timeout: float = 30.0
) -> PortForward:
    """Dial a port-forward URL: SPDY directly, or SPDY tunnelled in WebSocket."""
    spdy_transport: ByteTransport
    if transport == "websocket":
        connection = await _websocket(url, (portforward.TUNNEL_PROTOCOL,), timeout)
        spdy_transport = WebSocketTransport(connection, grace=1.0)
    else:
        spdy_transport, _protocol = await _spdy_upgrade(url, (portforward.PROTOCOL,), timeout)
    spdy = SpdySession(spdy_transport, client=True, limits=limits)
    return PortForward(spdy, asyncio.create_task(spdy.run()), timeout)


async def _spdy_upgrade(url: str, protocols: tuple[str, ...], timeout: float) -> tuple[StreamTransport, str]:
    """POST the upgrade request; the 101's transport (with any bytes after it) and protocol."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise StreamingClientError(f"{url!r} is not an absolute http URL")
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
        try:
            http = h11.Connection(h11.CLIENT)
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            headers = [
                ("Host", parts.netloc),
                ("Connection", "Upgrade"),
                ("Upgrade", "SPDY/3.1"),
                *(("X-Stream-Protocol-Version", protocol) for protocol in protocols),
                ("Content-Length", "0"),
            ]
            writer.write(http.send(h11.Request(method="POST", target=target, headers=headers)) or b"")
            writer.write(http.send(h11.EndOfMessage()) or b"")
            await writer.drain()
            response = await _read_response(http, reader)
        except BaseException:
            writer.close()
            raise
    if isinstance(response, h11.InformationalResponse) and response.status_code == 101:
        chosen = {name.lower(): value for name, value in response.headers}.get(
            b"x-stream-protocol-version", b""
        )
        extra, _closed = http.trailing_data
        return StreamTransport(reader, writer, bytes(extra)), chosen.decode()
    body = await _read_body(http, reader)
    writer.close()
    raise StreamingClientError(
        f"the server answered {response.status_code}: {body.strip()}", response.status_code
    )


async def _read_response(
    http: h11.Connection, reader: asyncio.StreamReader
) -> h11.Response | h11.InformationalResponse:
    while True:
        event = http.next_event()
        if isinstance(event, h11.Response | h11.InformationalResponse):
            return event
        if event is h11.NEED_DATA:
            data = await reader.read(_RESPONSE_LIMIT)
            if not data:
                raise StreamingClientError("the server closed the connection without an answer")
            http.receive_data(data)
        elif isinstance(event, h11.ConnectionClosed):
            raise StreamingClientError("the server closed the connection without an answer")


async def _read_body(http: h11.Connection, reader: asyncio.StreamReader) -> str:
    body = bytearray()
    with contextlib.suppress(h11.ProtocolError, OSError):
        while len(body) < _RESPONSE_LIMIT:
            event = http.next_event()
            if isinstance(event, h11.Data):
                body += event.data
            elif event is h11.NEED_DATA:
                data = await reader.read(_RESPONSE_LIMIT)
                if not data:
                    break
                http.receive_data(data)
            else:
                break
    return body.decode("utf-8", "replace")


async def _websocket(url: str, protocols: tuple[str, ...], timeout: float) -> WebSocketConnection:
    """The WebSocket handshake (h11 for the HTTP, `websockets` for frames from then on)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise StreamingClientError(f"{url!r} is not an absolute http URL")
    key = generate_key()
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
        try:
            http = h11.Connection(h11.CLIENT)
            headers = [
                ("Host", parts.netloc),
                ("Connection", "Upgrade"),
                ("Upgrade", "websocket"),
                ("Sec-WebSocket-Key", key),
                ("Sec-WebSocket-Version", "13"),
                ("Sec-WebSocket-Protocol", ", ".join(protocols)),
            ]
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            writer.write(http.send(h11.Request(method="GET", target=target, headers=headers)) or b"")
            await writer.drain()
            response = await _read_response(http, reader)
        except BaseException:
            writer.close()
            raise
    if not (isinstance(response, h11.InformationalResponse) and response.status_code == 101):
        body = await _read_body(http, reader)
        writer.close()
        raise StreamingClientError(
            f"the server answered {response.status_code}: {body.strip()}", response.status_code
        )
    answered = {name.lower(): value.decode("latin-1") for name, value in response.headers}
    chosen = answered.get(b"sec-websocket-protocol")
    if answered.get(b"sec-websocket-accept") != accept_key(key) or (
        chosen is not None and chosen not in protocols
    ):
        writer.close()
        raise StreamingClientError(f"the server's WebSocket handshake is invalid: {answered}")
    connection = WebSocketConnection.opened(reader, writer, chosen, _MAX_MESSAGE)
    extra, _closed = http.trailing_data
    await connection.receive_initial(bytes(extra))
    return connection
